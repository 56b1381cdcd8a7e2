"""What the jobs share to run code inside a vLLM environment, and to report."""
