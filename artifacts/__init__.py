"""Run artefacts: the run directory and everything written into it (checkpoints, CSV logs, plots, the cron
evaluator's ledger and lock), and the loader of a trained model. Built on core, config, datasets and models."""
