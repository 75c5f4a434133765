"""Stand-ins for remote services, run as real HTTP servers on 127.0.0.1 for tests and benchmarks: the Gemini REST
API (`fake_gemini`, its JSON in `gemini_format`, batches in `fake_batches`), an OpenAI-compatible server
(`fake_openai`), what both read back from medbanana's prompts (`wire`), the cheap `echo` engine, and fault
injection (`faults`)."""
