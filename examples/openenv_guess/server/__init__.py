"""The guessing game's server side: the Environment and its FastAPI app."""
