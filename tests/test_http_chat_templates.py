"""Chat prompts of the template families whose tokenizers add BOS themselves (Llama 3, Mistral, Gemma):
the prompt ids are transformers' `apply_chat_template(..., add_generation_prompt=True, tokenize=True)`,
one BOS and not two; and a template that fails on the messages with any error is a 400 on `messages`."""

from __future__ import annotations

import pytest

from engine.serve.chat_schema import parse_chat
from engine.serve.chat_template import ChatTemplate
from engine.serve.schemas import Limits
from http_helpers import openai_client as _client, serving, transformers_chat_ids, write_chat_checkpoint

import openai  # noqa: E402 - in the test extra: a missing one fails, never skips

# The shapes of each family's template (written for these tests): each writes `bos_token` itself.
LLAMA3 = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}")
MISTRAL = ("{{- bos_token }}{%- for message in messages %}{%- if message['role'] == 'user' %}"
           "{{- '[INST] ' + message['content'] + '[/INST]' }}{%- elif message['role'] == 'assistant' %}"
           "{{- ' ' + message['content'] + eos_token }}{%- endif %}{%- endfor %}")
GEMMA = ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' "
         "else message['role'] %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
FAMILIES = {"llama3": LLAMA3, "mistral": MISTRAL, "gemma": GEMMA}
MESSAGES = [{"role": "user", "content": "Bonjour, ça va?"}, {"role": "assistant", "content": "Oui."},
            {"role": "user", "content": "Et toi?"}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param) / "ckpt"
    return request.param, write_chat_checkpoint(directory, FAMILIES[request.param], adds_bos=True)




class TestPromptIds:
    def test_prompt_ids_are_transformers(self, family):
        """The chat body's prompt ids equal transformers' apply_chat_template ids: one BOS, not two."""
        from engine.model.checkpoint import load_checkpoint

        _, directory = family
        _, model_config, tokenizer = load_checkpoint(directory)
        limits = Limits(model_config.vocab_size, 512, 511, "m")
        body, _ = parse_chat({"messages": MESSAGES}, limits, tokenizer, ChatTemplate.for_model(str(directory)))
        expected = transformers_chat_ids(directory, MESSAGES)
        assert body.token_ids == expected
        assert expected.count(model_config.bos_token_id) == 1 and expected[0] == model_config.bos_token_id

    @pytest.mark.asyncio
    async def test_served_prompt_is_counted_once(self, family):
        """Through the server and the openai client, the prompt is transformers' ids (usage counts them)."""
        _, directory = family
        expected = transformers_chat_ids(directory, MESSAGES)
        async with serving(model=str(directory), max_context=512) as (_, client):
            oa = _client(client)
            try:
                answer = await oa.chat.completions.create(model=str(directory), messages=MESSAGES, max_tokens=2,
                                                          temperature=0)
            finally:
                await oa.close()
        assert answer.usage.prompt_tokens == len(expected)


class TestTemplateErrors:
    @pytest.mark.asyncio
    async def test_a_template_failing_on_null_content_is_400_on_messages(self, tmp_path):
        """An assistant `content: null` (the schema accepts it) that the template cannot add to a string
        (a TypeError, not a jinja error) is a 400 naming `messages`, not a 500; the engine sees nothing."""
        directory = write_chat_checkpoint(tmp_path / "mistral", MISTRAL, adds_bos=True)
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                    {"role": "user", "content": "again"}]
        async with serving(model=str(directory), max_context=512) as (engine, client):
            response = await client.post("/v1/chat/completions", json={"messages": messages})
            oa = _client(client)
            try:
                with pytest.raises(openai.BadRequestError) as raised:
                    await oa.chat.completions.create(model=str(directory), messages=messages)
            finally:
                await oa.close()
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "messages", error
        assert "TypeError" in error["message"] and raised.value.status_code == 400
        assert engine.stats.submitted == 0
