"""The launcher: materialize a model package into a verified local cache, then start and gate it.

Modules: `package` (model.json schema), `build` (package an HF folder), `storage` (S3 / local
transfers), `cache` (content-addressed cache, locks, LRU), `materialize` (package URI -> local
model dir), `plugins` (wheel install and entry-point discovery), `metrics_dir`
(PROMETHEUS_MULTIPROC_DIR hygiene), `gate` (public ports opened only once ready), `main` (CLI).
"""
