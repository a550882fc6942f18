"""The prompt enhancer's pieces: user prompts and vocabulary, and the rewriting policy."""
