"""The serving layer: a loop over engines (of one or several pools), the OpenAI-compatible
app built from route modules, metrics, launch (``serve``) and ``top``."""
