from featlearn.gpu.cli import main

main()
