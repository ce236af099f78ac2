"""`qmtp serve`: the model behind an OpenAI-compatible HTTP API.

`protocol` turns a request's JSON into the prompt's ids and a `qmtp.Settings` (every invalid field a 400
naming it), `stream` turns a row's tokens into text deltas (held back where a stop string or `</think>` may
be starting), `app` is the ASGI application (Starlette, its server-sent events from sse-starlette), `main`
the command line (uvicorn). The engine is given to the app: one thread runs it and owns MLX, the event loop
only hands it requests and reads their tokens back: `qmtp.continuous.ContinuousBatch`, whose rows share
every decoding step, drafting on.

Importing `qmtp` never imports this package: the web stack is the optional extra `serve`.
"""
