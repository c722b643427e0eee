"""The agentic sandbox world: worlds of documents, one holding the digest of the world's secret."""
