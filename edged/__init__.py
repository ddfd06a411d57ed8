"""edged: the node daemon that creates, runs, confines and destroys sandboxes."""

__version__ = "0.1.0"
