"""enginewire.runtime."""
