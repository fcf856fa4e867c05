"""LazyTrain for Hugging Face."""
__version__ = "0.1.0"
