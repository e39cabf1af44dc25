"""What the tests and the benches drive the project with from outside (torchrun groups killed and compared, the
long-range families' probes): above every layer of the runtime, imported by tests/ and bench/, never by the
runtime; bench/ only measures, and tests/ import nothing from it."""
