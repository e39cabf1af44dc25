"""train.py's loop and what it builds: the model, optimizer and data (build), the optimizer step in training
chunks (step, chunked_forward), the OOM back-off, the feature bank, precise BN, Ctrl-C."""
