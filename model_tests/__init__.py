"""enginewire.model_tests."""
