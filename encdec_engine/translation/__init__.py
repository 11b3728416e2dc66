"""Text tasks on the engine: translation (each model family's language conventions) and the task settings
summarization shares with it."""
