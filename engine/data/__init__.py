"""The DataLoaders of a run: of videos (loaders) and of feature files (feature_files)."""
