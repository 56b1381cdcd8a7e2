"""``vllm-patch bench``: evidence for the change, measured on this machine
(``command`` reads the command line, ``evidence`` writes the folder)."""
