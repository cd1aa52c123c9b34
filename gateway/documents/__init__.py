"""Documents and retrieval (RAG) in the gateway: extraction, chunking, embeddings, indexes, jobs, API."""
