"""The one wrapper around every event of the page: `GuardedBlocks` is the page's gr.Blocks,
and every event registered on it (whatever tab wires it, now or later) runs through its
`process_api`.

- What a client sends is checked against the component it is sent for before any handler
  runs (text for a text box, a number for a slider, one of the choices' kind for a radio, an
  uploaded file's record for a file input, no lone surrogate anywhere, a text box's
  `max_length`): a mistake is refused in one line naming the field.
- A failure after that is a one-line error: a QuickdraftError's own message (written for
  people), a value Gradio could not read as the field's, or, for anything else, a line
  with an id while the traceback goes to the log under that id (app.failures). Python's
  own text (types, paths, validators' dumps) never reaches the page.
- A handler that returns `{}` (nothing to change) leaves every output as it is.
"""

from __future__ import annotations

import html
import logging
import re
from pathlib import Path

import gradio as gr
from gradio.exceptions import ComponentProcessingError, InvalidPathError
from gradio.utils import get_upload_folder

from app.failures import report
from engine.errors import QuickdraftError
from engine.stored_files import lone_surrogate

log = logging.getLogger(__name__)

# Gradio's message for a value a component could not read names the input's index.
_PREPROCESS = re.compile(r"Could not preprocess input component at index (\d+)")


class GuardedBlocks(gr.Blocks):
    """gr.Blocks whose events answer every mistake and failure in one line (see the
    module docstring)."""

    async def process_api(self, block_fn, inputs, state=None, request=None, iterator=None,
                          *args, **kwargs):
        fn = self.fns[block_fn] if isinstance(block_fn, int) else block_fn
        if iterator is None and not fn.batch:  # a generator's later steps send nothing
            _check_inputs(fn, inputs, state)
        try:
            return await super().process_api(block_fn, inputs, state, request, iterator,
                                              *args, **kwargs)
        except gr.Error:
            raise
        except QuickdraftError as exc:  # written for people
            raise _error(str(exc)) from exc
        except (InvalidPathError, ComponentProcessingError) as exc:
            found = _PREPROCESS.search(str(exc))
            if isinstance(exc, InvalidPathError) or found is not None:
                name = field_name(fn.inputs[int(found[1])]) if found else "a file"
                raise _error(f"{name}: not a value this field takes") from exc
            raise _error(report(log, f"the page's {fn.name} event", exc)) from exc
        except Exception as exc:  # noqa: BLE001 - one line for the page, the rest to the log
            raise _error(report(log, f"the page's {fn.name} event", exc)) from exc

    async def postprocess_data(self, block_fn, predictions, state):
        if isinstance(predictions, dict) and not predictions and block_fn.outputs:
            predictions = [gr.skip() for _ in block_fn.outputs]  # `{}`: nothing to change
        return await super().postprocess_data(block_fn, predictions, state)


def field_name(component) -> str:
    """What the page calls a component: its label, else its placeholder, else its id."""
    for name in (getattr(component, "label", None), getattr(component, "placeholder", None),
                 getattr(component, "elem_id", None)):
        if isinstance(name, str) and name.strip():
            return name.strip().rstrip("…").removeprefix("qd-")
    return type(component).__name__.lower()


def _check_inputs(fn, inputs, state) -> None:
    """Refuse, naming the field, a value a component of `fn` cannot take (gr.Error). A
    component as this browser session has it (its choices change per session) is judged."""
    if not isinstance(inputs, list) or len(inputs) < len(fn.inputs):
        raise _error(f"this event takes {len(fn.inputs)} values")
    for i, component in enumerate(fn.inputs):
        if component.stateful or i in fn.component_prop_inputs:
            continue  # state is the server's own, never the client's
        if state is not None and component._id in state:
            component = state[component._id]
        why = value_problem(component, inputs[i])
        if why is not None:
            raise _error(f"{field_name(component)}: {why}")


def value_problem(component, value) -> str | None:
    """Why `value` cannot be sent for `component`; None when it can (or is None: every
    field may be empty, and its handler decides whether that is fine)."""
    if value is None:
        return None
    if lone_surrogate(value) is not None:
        return "holds a character that is not valid text (a lone surrogate)"
    if isinstance(component, gr.Textbox):
        if not isinstance(value, str):
            return "must be text"
        limit = getattr(component, "max_length", None)
        if limit and len(value) > limit:
            return f"is longer than {limit:,} characters"
    elif isinstance(component, gr.Checkbox):
        if not isinstance(value, bool):
            return "must be true or false"
    elif isinstance(component, gr.Slider | gr.Number):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "must be a number"
    elif isinstance(component, gr.Radio | gr.Dropdown):
        many = isinstance(component, gr.Dropdown) and component.multiselect
        items = value if many and isinstance(value, list) else [value]
        if not all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in items):
            return "must be one of its choices"
        custom = isinstance(component, gr.Dropdown) and component.allow_custom_value
        choices = [c[1] if isinstance(c, tuple | list) else c for c in component.choices or []]
        if not custom and not all(v in choices for v in items):
            return "must be one of its choices"
    elif isinstance(component, gr.File):
        items = value if isinstance(value, list) else [value]
        if not all(_uploaded(v) for v in items):
            return "must be a file uploaded to this page"
    return None


def _uploaded(value) -> bool:
    """Whether `value` is Gradio's record of a file in the upload folder (resolved: no
    relative path, link or "..", whether or not the page has been launched yet)."""
    if not (isinstance(value, dict) and isinstance(value.get("path"), str)
            and value.get("meta") == {"_type": "gradio.FileData"}):
        return False
    try:
        path = Path(value["path"]).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):
        return False
    return path.is_file() and path.is_relative_to(Path(get_upload_folder()).resolve())


def _error(message: str) -> gr.Error:
    # gr.Error's message is shown as HTML: what a client sent must not become markup
    return gr.Error(html.escape(message), print_exception=False)
