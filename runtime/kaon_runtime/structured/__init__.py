"""Structured output: grammar-constrained decoding (JSON schema, regex, choice, EBNF) and tool calls.

  spec.py          a request's constraint as a hashable GrammarSpec (the cache key)
  compiler.py      GrammarCache: xgrammar's compiler for one tokenizer, compiled grammars by spec
  compile_worker.py  a compile with a deadline: in a forked child, killed when it runs past it
  matcher.py       SequenceGrammar: one sequence's matcher (next-token mask, accept, rollback)
  grammars.py      Grammars: what the engine calls (check a request, a matcher per sequence)
  masks.py         apply_bitmasks: the batch's masks onto the logits, other rows untouched
  step_masks.py    StepMasks: the masks of one step, filled on a worker thread during the forward pass
  tool_parsers.py  tool calls out of text (Hermes, Llama 3 JSON, Mistral)
  tool_grammar.py  the grammar that forces a call (tool_choice required or named)
  tool_prompt.py   tools and tool calls into chat messages, for templates that do not know them

The engine imports it (masks before sampling); the server imports the tool parts. It imports
only the loader (the tokenizer), sampling and errors.
"""
