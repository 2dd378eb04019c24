"""Models tab: the bundled model, a local folder, a GGUF file (LM Studio's and Ollama's are
listed) or a Hugging Face repo id; quantization with its memory estimate; loading with
progress. Whether a model may run its own code is shown, never asked: only the command line
can allow it (a page event can be sent by any web page that reaches the server)."""

from __future__ import annotations

import time

import gradio as gr
import torch

from app import catalog
from app.host import model_name, step_line
from app.quant_words import kernel_words, quant_record
from app.service import Service
from app.ui import readout
from engine.config import ModelSpec
from engine.errors import QuickdraftError


def quant_labels(device: str) -> list[tuple[str, str]]:
    """The quantization choices, each with the kernels that run it on `device` here."""
    return [("Auto", "auto"), ("GGUF file's own blocks", "gguf"),
            (f"4-bit ({kernel_words('int4', device)})", "int4"),
            (f"8-bit ({kernel_words('int8w', device)})", "int8w"),
            ("4-bit NF4 (bitsandbytes)", "nf4"), ("8-bit (bitsandbytes)", "int8"),
            ("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32")]


BUNDLED = ("Bundled: SmolLM2-135M-Instruct (no download)", "default")
QUANT_INFO = ("Auto: a quantized GGUF file runs on its own blocks, as stored; other models, "
              "on a CPU, measured the first time they load (bf16, 8-bit or 4-bit weights; what "
              "it chose and why shows above); on a GPU, bf16 (fp16 on cards before RTX 30xx), "
              "or 4 bits where that would not fit with its KV cache")
POLL_S = 0.3  # how often the page hears about a load in progress


class ModelsTab:
    """The components of the models tab and their event handlers."""

    def __init__(self, service: Service):
        self.service = service
        s = service.store.load_settings()
        self.current = gr.Markdown(elem_id="qd-model-current")
        with gr.Row(equal_height=True):
            self.source = gr.Dropdown([BUNDLED], value=s.model, allow_custom_value=True,
                                      label="Model", scale=5, elem_id="qd-model-source",
                                      info="the bundled model, a Hugging Face repo id "
                                           "(owner/name, or owner/name:file.gguf), the path "
                                           "of a local folder or of a .gguf file")
            self.refresh_btn = gr.Button("Refresh list", scale=0, min_width=110, size="sm",
                                         elem_id="qd-model-refresh")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.quant = gr.Radio(quant_labels(device), value=s.quant, label="Quantization",
                              info=QUANT_INFO, elem_id="qd-model-quant")
        self.estimate = gr.Markdown(elem_id="qd-model-estimate")
        gr.Markdown(trust_note(service.host.trusted), elem_id="qd-model-trust")
        with gr.Row():
            self.load_btn = gr.Button("Load model", variant="primary", elem_id="qd-model-load")
            self.requant_btn = gr.Button("Measure Auto's choice again", size="sm", scale=0,
                                         min_width=220, elem_id="qd-model-requantize")
        self.status = gr.HTML(elem_id="qd-model-status")

    def wire(self) -> gr.events.Dependency:
        """Wire the tab; returns the load event so other tabs can follow it."""
        self.refresh_btn.click(self.choices, None, [self.source], concurrency_limit=None)
        gr.on([self.source.change, self.quant.change], self.memory, [self.source, self.quant],
              [self.estimate], concurrency_limit=None)
        self.requant_btn.click(self.requantize, [self.source], [self.status, self.current],
                               concurrency_id="load")
        return self.load_btn.click(self.load, [self.source, self.quant],
                                   [self.status, self.current], concurrency_id="load")

    def refresh(self) -> dict:
        """On page load: the current model, the cached list, the startup notice."""
        s = self.service.store.load_settings()
        notice = readout.error_html(self.service.host.notice) if self.service.host.notice else ""
        return {self.current: self.describe(), self.source: self.choices(s.model),
                self.estimate: self.memory(s.model, s.quant), self.status: notice}

    def describe(self) -> str:
        """The loaded model: its figures measured from its modules, and its quantization."""
        try:
            lm = self.service.host.lm
        except QuickdraftError as exc:
            return f"**No model loaded.** {exc}"
        params, size = catalog.measured_size(lm.model)
        return (f"**Loaded: {model_name(lm)}** (`{lm.model_id}`) · "
                f"<span id='qd-model-params'>{params / 1e6:,.1f} M parameters</span> · "
                f"<span id='qd-model-bytes'>{size / 2**20:,.1f} MB in memory</span> · "
                f"{lm.context_len} tokens of context · loaded in {lm.load_seconds:.1f} s\n\n"
                f"Quantization: {quant_record(lm)}\n\nDevice: {lm.device_line or lm.device}"
                f"\n\nDecode step: {step_line(lm)}")

    def choices(self, value: str | None = None) -> gr.Dropdown:
        """The bundled model, every model already in the Hugging Face cache, and the GGUF
        models of LM Studio and Ollama (converted once when loaded)."""
        cached = [(repo, repo) for repo in catalog.cached_models()]
        return gr.Dropdown(choices=[BUNDLED, *cached, *catalog.gguf_models()],
                           value=value if value is not None else gr.skip())

    def memory(self, source, quant) -> str:
        try:
            spec = ModelSpec(source=source or "default", quant=quant)
            lm = self.service.host.current  # when `spec` names it, its bytes are measured
            same = lm is not None and lm.spec.source == spec.source and \
                spec.quant in ("auto", lm.quant)
            return catalog.memory_estimate(spec, lm if same else None)
        except QuickdraftError as exc:  # what loading it would say: a path with nothing there
            return f"⚠ {exc}"
        except (OSError, ValueError) as exc:
            return f"Cannot estimate the size: {exc}"

    def requantize(self, source):
        """Load `source` with Auto's quantization measured again (answers and speed here)."""
        yield from self.load(source, "auto", requantize=True)

    def load(self, source, quant, requantize: bool = False):
        """Load in the background and report progress; on failure the old model stays. The
        service decides whether the model may run its own code (the command line's choice)."""
        try:
            job = self.service.host.start_load(ModelSpec(source=source or "default", quant=quant,
                                                         requantize=requantize))
        except QuickdraftError as exc:
            yield readout.error_html(str(exc)), gr.skip()
            return
        while job.running:
            yield readout.job_html(job), gr.skip()
            time.sleep(POLL_S)
        if job.state == "failed":
            still = model_name(self.service.host.lm)
            yield readout.error_html(f"{job.error} (still using {still})"), gr.skip()
            return
        done = job.progress.message if job.progress else "loaded"
        yield readout.note_html(done), self.describe()


def trust_note(trusted: str | None) -> str:
    """What the page says about models that ship their own code (read-only)."""
    if trusted:
        return (f"Remote code: allowed for `{trusted}` only (started with "
                "`--trust-remote-code`).")
    return ("Remote code: off. A model that ships its own Python code loads only when the app "
            "is started with `--model NAME --trust-remote-code`.")
