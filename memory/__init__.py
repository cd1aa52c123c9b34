"""Session memory: durable conversations (storage, context composition, summarisation).

``memory.store`` keeps sessions, turns, summaries and turn vectors in SQL (SQLAlchemy Core,
versioned migrations); ``memory.compose`` fits a conversation to a token budget;
``memory.service`` ties them to an embedder and a summariser it is given. This package is a library the
gateway calls: its side (the HTTP routes in ``gateway.sessions``, the chat request's window fit in
``gateway.memory_chat``) lives in the gateway. Nothing here imports the gateway or the engine
(tests/common/test_layering.py, docs/memory.md).
"""
