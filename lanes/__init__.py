"""The lane server: one OpenAI-compatible aiohttp process around one pinned engine instance."""
