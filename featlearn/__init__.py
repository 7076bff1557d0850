"""featlearn: feature-learning theory of self-supervised learning as runnable Lightning experiments."""
from featlearn.errors import ConfigError, DivergenceError

__all__ = ["ConfigError", "DivergenceError"]
__version__ = "0.1.0"
