"""Text formats around the model: chat templates (:mod:`~llama.formats.chat`), tool
declarations and tool calls (:mod:`~llama.formats.tool_prompts`,
:mod:`~llama.formats.tool_calls`), a chat request's tool rules, the one planner the Python API
and the server both follow (:mod:`~llama.formats.chat_request`: which tools are declared, how
``tool_choice`` and ``response_format`` combine, how a reply becomes a message), Code Llama
infilling (:mod:`~llama.formats.infilling`), a conversation kept across turns
(:mod:`~llama.formats.session`) and a message's content as text and image parts
(:mod:`~llama.formats.content`).  No torch here: a dialog's images are preprocessed by
:mod:`llama.images.preprocess`, imported only when a dialog holds one."""
