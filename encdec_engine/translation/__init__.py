"""Text tasks above the engine: translation and summarization, for LLM.translate / summarize and the server.

    languages.py       languages as users name them, and the codes each translation family spells them with
    conventions.py     how each family of translation models is told the languages
    tasks.py           prompts, sampling parameters and result text of translation and summarization
                       (LLM.translate / summarize, the completions endpoint's target_language)
"""
