"""``python -m featlearn.bench op|step ...`` (the same as ``featlearn bench ...``)."""
from featlearn.bench.cli import main

main()
