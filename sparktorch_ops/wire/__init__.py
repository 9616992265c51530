"""What every side shares: the channel, its messages, TLS, payloads and the environment
contract. Standard library only; imports nothing of ours outside wire/ but errors."""

#: This package's version (``sparktorch_ops.__version__``; the zip shipped to the executors is
#: named by it). Here, where every side may read it: nothing inside the package imports its root.
VERSION = "0.1.0"
