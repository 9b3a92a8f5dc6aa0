"""Reusable evaluation on the engine: streaming perplexity (`perplexity`), statistics (`stats`), what every
long run needs (`runtime`: one-line config errors, status and progress, memory checks, atomic JSON), the request
harness (`harness`) and the lm-eval model (`lm_eval_model`). Imports the core and models, never a study or a
command line."""
