"""enginewire.benchmarks."""
