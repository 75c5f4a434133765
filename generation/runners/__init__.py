"""Drive the refinement loop over many tasks: in one process (`local`), in worker processes (`processes`), through
the Gemini Batch API (`batch`); `generate` turns command-line options into a run, and the offline demo."""
