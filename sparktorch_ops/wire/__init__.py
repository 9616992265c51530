"""What every side shares: the channel, its messages, TLS, payloads and the environment
contract. Standard library only; imports nothing of ours outside wire/ but errors."""
