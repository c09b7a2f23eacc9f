"""The router process: the OpenAI-compatible HTTP API, admission, dispatch to the workers, tools, structured
outputs, chat templates, the Responses API, metrics and logs (server.py lists the pieces)."""
