"""Text formats around the model: chat templates (:mod:`~llama.formats.chat`), tool
declarations and tool calls (:mod:`~llama.formats.tool_prompts`,
:mod:`~llama.formats.tool_calls`), Code Llama infilling (:mod:`~llama.formats.infilling`)
and a conversation kept across turns (:mod:`~llama.formats.session`).  No torch here."""
