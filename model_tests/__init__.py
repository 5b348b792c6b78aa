"""enginewire.testing: Hypothesis campaigns, the conformance suite, the fault matrix and the
checkers that do I/O (SPIN, generated-file freshness); installed from ``model_tests/``."""
