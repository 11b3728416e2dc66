"""Every path the server answers, written once: the endpoints (info.py, completions.py, audio.py,
realtime.py), the app's documentation pages (app.py), the gate's checks (gate.py), the per-endpoint
metrics and the OpenAPI document (openapi.py) all read these names. A leaf: it imports nothing.
"""

from __future__ import annotations

# The OpenAI-compatible API.
COMPLETIONS = "/v1/completions"  # text models
TRANSCRIPTIONS = "/v1/audio/transcriptions"  # audio models, as the next two
TRANSLATIONS = "/v1/audio/translations"
REALTIME = "/v1/realtime"  # a websocket
MODELS = "/v1/models"
MODEL = "/v1/models/{model_id:path}"
API_PREFIX = "/v1"  # what the API key guards

# What the server tells about itself.
HEALTH = "/health"
METRICS = "/metrics"
DOCS = "/docs"  # Swagger UI, served from the swagger-ui-bundle package
DOCS_STATIC = "/docs/static"
DOCS_OAUTH2_REDIRECT = "/docs/oauth2-redirect"
REDOC = "/redoc"
OPENAPI = "/openapi.json"

AUDIO_PATHS = (TRANSCRIPTIONS, TRANSLATIONS)  # uploads: the audio memory budget reserves their bytes
TEXT_PATHS = (COMPLETIONS,)
METERED_PATHS = (COMPLETIONS, TRANSCRIPTIONS, TRANSLATIONS, MODELS)  # timed per endpoint in /metrics
# The load and the API's shape: guarded when ServerLimits.protects_info.
INFO_PATHS = (METRICS, DOCS, DOCS_OAUTH2_REDIRECT, REDOC, OPENAPI)
