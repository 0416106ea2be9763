"""Adapters that embed kvstage in serving engines (each imports its engine lazily)."""
