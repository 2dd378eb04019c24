"""Train accelerator tab: method, time budget and optional prompts; the background run's
progress bar, stage, ETA and live loss / accuracy; Cancel (the next run resumes)."""

from __future__ import annotations

from pathlib import Path

import gradio as gr

from app.drafting import accel_label
from app.host import model_name
from app.service import Service
from app.settings_rules import page_choice, page_number, page_text
from app.training import training_summary
from app.ui import readout
from app.ui.readout import page_words
from engine.drafters.registry import TRAINED
from engine.errors import QuickdraftError

INTRO = """The loaded model answers a set of seed prompts (self-distillation); the drafter is
then trained to predict the model's own next tokens, calibrated on this machine, and stored
next to this model's fingerprint. **Cancel** keeps the answers generated so far: the next run
resumes from them. When a run finishes, the new accelerator is switched on in the Chat tab
and a Compare runs. **Retrain** starts from the accelerator already trained for this model
(with the data gathered so far plus anything new) instead of starting from nothing."""
CHATS_LABEL = "Learn from my chats with this model (they stay on this computer)"
CHATS_INFO = ("The model's own replies in your conversations with it are training data on "
              "exactly the prompts you ask, and each finished reply joins the datastore that "
              "drafts from what the model said before. Stopped replies are left out.")
CPU_NOTE = ("No GPU here: training and chat share the processor, so replies are slower "
            "while a run is going.")
TICK_S = 1.0  # how often the page polls a running job
# The smallest time budget offered. Any budget collects the least data training needs
# (trainer/pipeline.py LEAST_DATA); 3 minutes on the bundled model (int8w, 2-core AMD EPYC)
# ended with an accelerator in 175 s, where 1 minute leaves training itself a few seconds.
MIN_MINUTES = 3
CHART_WIDTH = 340  # px: narrower, a chart cuts its titles, so a narrow window stacks them
CHARTS_LATER = ("The loss and held-out accuracy charts below fill in once training starts, "
                "after the data and features stages.")
KEPT = ("The answers generated so far are kept: a run with a larger time budget continues "
        "from them.")
CANCELLED = ("Cancelled. The answers generated so far are kept: the next run continues from "
             "them. The accelerator trained before is unchanged.")


class TrainTab:
    """The components of the train tab and their event handlers."""

    def __init__(self, service: Service):
        self.service = service
        gr.Markdown(INTRO)
        self.target = gr.Markdown(elem_id="qd-train-target")
        with gr.Row():
            self.method = gr.Radio([(accel_label(m), m) for m in TRAINED], value=TRAINED[0],
                                   label="Method", elem_id="qd-train-method")
            self.minutes = gr.Slider(MIN_MINUTES, 240, 20, step=1,
                                     label="Time budget (minutes)", elem_id="qd-train-minutes")
        self.prompts = gr.File(label="Extra prompts (optional): JSONL with one "
                                     '{"prompt": ...} per line, or one prompt per line',
                               file_types=[".jsonl", ".txt"], type="filepath", height=120)
        learn = self.service.store.load_settings().learn_from_chats
        self.chats = gr.Checkbox(learn, label=CHATS_LABEL,
                                 info=CHATS_INFO,
                                 elem_id="qd-train-chats")
        with gr.Row():
            self.start_btn = gr.Button("Start training", variant="primary",
                                       elem_id="qd-train-start")
            self.retrain_btn = gr.Button("Retrain (continue from the current accelerator)",
                                         elem_id="qd-train-retrain")
            self.cancel_btn = gr.Button("Cancel", variant="stop", elem_id="qd-train-cancel")
        self.status = gr.HTML(elem_id="qd-train-status")
        # Always laid out; a chart gets its figures only once a run reports some (tick): one
        # first drawn from an empty table keeps a plot 0 px high and a cut title.
        chart = dict(x="minutes", y="value", color="metric", height=200,
                     x_title="minutes into the run", color_title="", min_width=CHART_WIDTH)
        with gr.Row():
            self.loss_plot = gr.LinePlot(title="Training loss (this run)", y_title="loss",
                                         elem_id="qd-train-loss", **chart)
            self.acc_plot = gr.LinePlot(y_lim=[0, 1], title="Held-out accuracy (this run)",
                                        y_title="share right",  # a longer title is cut
                                        elem_id="qd-train-accuracy", **chart)
        self.timer = gr.Timer(TICK_S, active=False)
        # "<method>@<start time>" of the last run that finished; the chat tab follows it
        self.finished = gr.State("")

    def wire(self) -> None:
        fast = dict(concurrency_limit=None, show_progress="hidden")
        inputs = [self.method, self.minutes, self.prompts, self.chats]
        self.start_btn.click(self.start, inputs, [self.status, self.timer], **fast)
        self.retrain_btn.click(self.retrain, inputs, [self.status, self.timer], **fast)
        self.cancel_btn.click(self.cancel, None, [self.status], **fast)
        # the same switch keeps replies out of the datastore
        remember = self.service.store.remember
        self.chats.change(lambda on: remember(learn_from_chats=bool(on)) and None,
                          [self.chats], None, **fast)
        self.timer.tick(self.tick, None, self.tick_outputs, **fast)

    @property
    def tick_outputs(self) -> list:
        return [self.status, self.loss_plot, self.acc_plot, self.timer, self.finished]

    def refresh(self) -> dict:
        """On page load, and after a model load: what will be trained, and any run going."""
        try:
            lm = self.service.host.lm
            target = f"Trains for **{model_name(lm)}** ({lm.quant} on {lm.device})."
            if lm.device.type == "cpu":
                target += " " + CPU_NOTE
            target += "\n\n" + training_summary(lm, self.service.store)
        except QuickdraftError as exc:
            target = str(exc)
        job = self.service.training.job
        out = self.tick()
        out.pop(self.finished, None)  # a run that ended while the page was closed is not news
        out[self.target] = target
        out[self.timer] = gr.Timer(active=job is not None and job.running)
        return out

    def start(self, method, minutes, prompts, chats, continue_training: bool = False):
        from trainer.pipeline import options_for

        try:
            method = page_choice("the method", method, TRAINED)
            minutes = page_number("train_minutes", minutes)
            prompts = page_text("the prompts file", prompts)
            options = options_for(method, minutes, Path(prompts) if prompts else None,
                                  continue_training=continue_training)
            job = self.service.training.start(options, learn_from_chats=bool(chats))
        except QuickdraftError as exc:
            return readout.error_html(page_words(str(exc))), gr.Timer(active=False)
        return readout.job_html(job), gr.Timer(active=True)

    def retrain(self, method, minutes, prompts, chats):
        """Start a run that continues from the stored accelerator (a fresh start, with a
        notice, when there is none that fits)."""
        return self.start(method, minutes, prompts, chats, continue_training=True)

    def cancel(self):
        job = self.service.training.job
        if job is None or not job.running:
            return gr.skip()
        self.service.training.cancel()
        return readout.job_html(job) + readout.note_html(
            "Cancelling: what was generated so far is kept for the next run…")

    def tick(self) -> dict:
        """The run's bar and charts: shown from its start (the charts fill in once training
        starts), its failure in the page's words."""
        job = self.service.training.job
        loss, acc = readout.metric_frames(job)
        out = {self.loss_plot: None if loss.empty else loss,  # see the charts' comment
               self.acc_plot: None if acc.empty else acc}
        notes = []
        if job is not None and job.running and loss.empty:
            notes.append(CHARTS_LATER)
        if job is not None and job.state == "failed" and "--max-minutes" in job.error:
            notes.append(KEPT)
        if job is not None and not job.running:
            out[self.timer] = gr.Timer(active=False)
            if job.state == "done":
                out[self.finished] = f"{job.method}@{job.started:.3f}"
                notes.append(self.service.accels.status(job.method).message)
            elif job.state == "cancelled":
                notes.append(CANCELLED)
        error = page_words(job.error) if job is not None else None
        out[self.status] = readout.job_html(job, error) + "".join(map(readout.note_html, notes))
        return out

