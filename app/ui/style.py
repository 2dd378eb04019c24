"""The page's style sheet: the readout's chips and bars, progress bars, and the layout on
narrow screens (the conversation and the message box first, the lists and settings after)."""

CSS = """

.qd-readout {display:flex; flex-wrap:wrap; gap:6px; align-items:center; font-size:0.9em;}
.qd-chip {padding:2px 8px; border-radius:10px; background:var(--block-background-fill);
  border:1px solid var(--border-color-primary); white-space:nowrap;}
.qd-method {background:var(--color-accent-soft); font-weight:600;}
.qd-ratio {background:#d1fae5; color:#065f46;} .qd-same {color:#047857;}
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
.qd-job-title {font-weight:600;} .qd-job-msg, .qd-job-figures {font-size:0.9em;}
.qd-which {opacity:0.7; font-style:italic;} .qd-sources {background:var(--color-accent-soft);}
.qd-repeated {color:#b45309; font-size:0.9em; margin-top:4px;}
.qd-header {font-size:0.95em;} .qd-header p {margin:0;}
.qd-queued {font-size:0.85em; opacity:0.8;}
#qd-queued:has(.prose:empty) {display:none;}  /* no gap while nothing is queued */
#qd-chatbot .bubble-wrap {padding-top:30px;}  /* the first message clear of Clear and Copy */
@media (max-width: 720px) {
  #qd-chat-col {order:-1;}
  #qd-chatbot {height:38vh !important; min-height:200px;}
  #qd-intro p {display:none;}
  .qd-readout {font-size:0.78em; gap:3px;}
}
"""
