"""The page's style sheet (the readout's chips and bars, progress bars, focus rings, the
layout on narrow screens: the conversation and the message box first, the lists and settings
after) and its one script: each radio group one Tab stop whose arrows move the choice."""

CSS = """

.qd-readout {display:flex; flex-wrap:wrap; gap:6px; align-items:center; font-size:0.9em;}
.qd-chip {padding:2px 8px; border-radius:10px; background:var(--block-background-fill);
  border:1px solid var(--border-color-primary); white-space:nowrap;}
.qd-method {background:var(--color-accent-soft); font-weight:600;}
.qd-ratio {background:#d1fae5; color:#065f46;} .qd-same {color:#047857;}
.qd-ratio.qd-slow, .qd-chip.qd-slow {background:#fef3c7; color:#92400e;}
.qd-ratio.qd-plain {background:transparent; color:inherit;}
.qd-slower {color:#92400e; font-size:0.9em; margin-top:4px;}
.qd-details {font-size:0.85em; margin-top:4px;} .qd-details summary {cursor:pointer;}
.qd-differ {color:#b45309;} .qd-mismatch {color:#dc2626; font-weight:600;}
.qd-live {opacity:0.7;}
.qd-hist {display:inline-flex; gap:2px; align-items:flex-end; height:30px;}
.qd-bar {display:inline-flex; flex-direction:column; align-items:center; width:12px;}
.qd-bar i {display:block; width:9px; background:var(--color-accent); border-radius:2px;}
.qd-bar small {font-size:0.65em; line-height:1;}
.qd-note {font-size:0.85em; opacity:0.8;} .qd-error {color:#b91c1c; font-weight:500;}
.qd-compare-prompt {font-size:0.85em; opacity:0.75; margin-bottom:4px;}
.qd-progress {height:10px; background:var(--border-color-primary); border-radius:5px;
  overflow:hidden; margin:6px 0;}
.qd-progress div {height:100%; background:var(--color-accent);}
.qd-failed .qd-progress div {background:#dc2626;} .qd-failed .qd-job-title {color:#b91c1c;}
.qd-cancelled .qd-progress div {background:#9ca3af;} .qd-cancelled .qd-job-title {opacity:0.75;}
.qd-done .qd-progress div {background:#059669;}
.qd-job-title {font-weight:600;} .qd-job-msg, .qd-job-figures {font-size:0.9em;}
.qd-which {opacity:0.7; font-style:italic;} .qd-sources {background:var(--color-accent-soft);}
.qd-repeated {color:#b45309; font-size:0.9em; margin-top:4px;}
.qd-header {font-size:0.95em;} .qd-header p {margin:0;}
.qd-queued {font-size:0.85em; opacity:0.8;}
#qd-queued:has(.prose:empty) {display:none;}  /* no gap while nothing is queued */
#qd-chatbot .bubble-wrap {padding-top:30px;}  /* the first message clear of Clear and Copy */
@media (max-width: 720px) {
  #qd-chat-col {order:-1;}
  #qd-chatbot {height:34vh !important; min-height:180px;}
  /* the message box, Send and Stop stay on one line */
  #qd-msg-row {flex-wrap:nowrap !important; gap:4px;}
  #qd-msg-row > div, #qd-msg-row > button {min-width:0 !important;}
  #qd-msg-row button {flex:0 0 auto !important; padding:0 6px; min-width:50px !important;}
  #qd-msg {padding:4px !important;}
  #qd-intro p {display:none;}
  .qd-readout {font-size:0.78em; gap:3px;}
}
/* keyboard: where the focus is must be plain to see, on radios and their labels too */
.gradio-container label:has(input[type=radio]:focus-visible),
.gradio-container label:has(input[type=checkbox]:focus-visible) {
  outline:3px solid var(--color-accent); outline-offset:2px;}
.gradio-container button:focus-visible, .gradio-container textarea:focus-visible,
.gradio-container input:focus-visible {outline:3px solid var(--color-accent); outline-offset:1px;}
"""

# Gradio names every radio button of a group differently, so each is its own Tab stop and
# the arrow keys do not move the choice. Giving a group's buttons one name makes the browser
# treat them as one group: one Tab stop, arrows select (and send the group's input event).
# Groups whose choices the page replaces (the conversation list) are named again.
RADIO_GROUPS = """
() => {
    let groups = 0;
    const name = () => document.querySelectorAll('input[type=radio]').forEach(radio => {
        const block = radio.closest('.block');
        if (!block) return;
        block.dataset.qdGroup = block.dataset.qdGroup || `qd-radio-${++groups}`;
        if (radio.name !== block.dataset.qdGroup) radio.name = block.dataset.qdGroup;
    });
    name();
    new MutationObserver(name).observe(document.body, {
        childList: true, subtree: true, attributes: true, attributeFilter: ['name']});
}
"""
