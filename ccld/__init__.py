"""ccld: find the rank and the link that make a distributed training job hang or crawl, while it runs."""
__version__ = "0.1.0"
