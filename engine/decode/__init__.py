"""The decode loop and what it is made of: the loop itself (generate.py), verification and
sampling math, token trees, the KV cache, the step target interface, timing, text
streaming, chat templates, logit rules and grammars, and the Drafter interface a drafting
source implements (drafter.py). Imports the engine's foundation only.
"""
