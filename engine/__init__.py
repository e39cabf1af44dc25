"""What the scripts run, by concept: ``training`` (train.py's loop and what a step needs), ``evaluation`` (scoring
a checkpoint, eval.py --watch, cross-validation), ``inference`` (streaming a video in inference chunks, its
timeline and feature files), over ``data`` (the DataLoaders of videos and of feature files) and ``metrics``. A
package imports only those after it in this list (.importlinter)."""
