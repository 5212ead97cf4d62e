"""The engine: requests in (processor), one step at a time (LLMEngine), outputs back (output processor)."""
