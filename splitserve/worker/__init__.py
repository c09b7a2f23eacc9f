"""A worker's front end process: its HTTP API (app.py), tokenization, detokenization and streams
(service.py, text_stream.py), and the client of its engine-core process (core_client.py); main.py is the
entry point (`python -m splitserve.worker.main`)."""
