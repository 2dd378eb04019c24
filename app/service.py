"""The app's engine room, one part per job: the model host (app/host.py), the accelerators
of its model (app/drafting.py), replies (app/replies.py) and training (app/training.py).
UI modules, CLI commands and the API use the part they need and only lay out results."""

from __future__ import annotations

from app.drafting import Accelerators
from app.host import ModelHost
from app.replies import Replies
from app.settings_saves import PageSettings
from app.store import Store
from app.training import Training
from engine.config import ModelSpec
from engine.decode.loaded import LoadedModel
from engine.progress import ProgressFn


class Service:
    """The parts over one store and one loaded model."""

    def __init__(self, store: Store, lm: LoadedModel | None = None):
        self.store = store
        self.host = ModelHost(store, lm)
        self.accels = Accelerators(store, self.host)
        self.replies = Replies(store, self.host, self.accels)
        self.training = Training(store, self.host)
        self.page_settings = PageSettings(store)  # the page's settings, saved as changes end

    @classmethod
    def open(cls, store: Store, spec: ModelSpec | None = None, step: str = "auto",
             background: bool = False, echo: ProgressFn | None = None) -> Service:
        """Start with `spec`, else the last model used, else the bundled one (where the
        one asked for cannot be loaded); `step`: how decode steps run for every model this
        service loads. `background`: return at once, the model loading behind (the page is
        served meanwhile, `host.loading` reports); `echo` hears the progress too."""
        settings = store.load_settings()
        service = cls(store)
        service.host.step = step
        service.host.echo = echo
        if spec is not None and spec.trust_remote_code:
            service.host.trusted = spec.source
        wanted = spec or ModelSpec(settings.model, settings.quant)
        if background:
            service.host.start_load(wanted, first=True)
        else:
            service.host.load_first(wanted, echo)
        return service
