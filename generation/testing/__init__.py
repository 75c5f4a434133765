"""Stand-ins for remote services, run as real HTTP servers on 127.0.0.1 for tests and benchmarks: the Gemini REST
API (with batches), an OpenAI-compatible server, the echo engine both answer with, and fault injection."""
