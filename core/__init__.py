"""The base layer: files and atomic writes, errors, the runtime (device, precision, process group), logging,
the command-line edge and memory readings. Imports nothing of the project's other packages."""
