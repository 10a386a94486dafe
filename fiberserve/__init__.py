"""fiberserve: an LLM inference server whose batches run on a pool of fibers."""

__version__ = "0.1.0"
