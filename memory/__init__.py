"""Session memory: durable conversations (storage, context composition, summarisation).

``memory.store`` keeps sessions, turns, summaries and turn vectors in SQL (SQLAlchemy Core,
versioned migrations); ``memory.compose`` fits a conversation to a token budget;
``memory.service`` ties them to the embedding model and the summariser; ``memory.chat`` and
``memory.api`` are the gateway's side. Nothing here imports the engine (docs/memory.md).
"""
