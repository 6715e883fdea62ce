"""The system as local processes: `flashmoe run`, the launcher and supervisor, `flashmoe
doctor`."""
