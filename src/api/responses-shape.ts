// OpenAI's Responses API on the wire: a `response` object whose output is one assistant message of output_text, and
// the typed stream events that build it (response.created ... response.output_text.delta ... response.completed),
// each an SSE event named by its type and numbered by sequence_number, with no [DONE] after the last.

import type { ErrorBody } from './errors.ts';
import type { ChatResponseMeta, WireFinishReason, WireUsage } from './openai-format.ts';
import type { ChoiceUpdate, ResponseShape } from './response-shapes.ts';
import type { ResponsesEcho } from './schemas/responses.ts';
import type { SseStyle } from './sse.ts';

type Status = 'in_progress' | 'completed' | 'incomplete';

export class ResponsesShape implements ResponseShape, SseStyle {
  readonly namedEvents = true;
  readonly doneMarker = false;
  private sequence = 0;
  private text = '';
  private finishReason: WireFinishReason | null = null;
  private readonly itemId: string;

  constructor(private readonly meta: ChatResponseMeta, private readonly echo: ResponsesEcho) {
    // The message is the response's only output item: its id is the response's, with the item's prefix.
    this.itemId = `msg-${meta.id.replace(/^resp-/, '')}`;
  }

  get sseStyle(): SseStyle {
    return this;
  }

  private event(type: string, fields: object): object {
    return { type, sequence_number: this.sequence++, ...fields };
  }

  private get status(): Status {
    if (this.finishReason === null) return 'in_progress';
    return this.finishReason === 'stop' ? 'completed' : 'incomplete';
  }

  private part(): object {
    return { type: 'output_text', text: this.text, annotations: [], logprobs: [] };
  }

  private item(withContent: boolean): object {
    return {
      id: this.itemId, type: 'message', status: this.status, role: 'assistant', content: withContent ? [this.part()] : [],
    };
  }

  /** The response object as it stands: in progress (no output yet), or finished with its message and usage. */
  private response(usage: WireUsage | null): object {
    const status = this.status;
    const { echo } = this;
    return {
      id: this.meta.id,
      object: 'response',
      created_at: this.meta.created,
      status,
      error: null,
      incomplete_details: status === 'incomplete' ? { reason: this.finishReason === 'length' ? 'max_output_tokens' : 'aborted' } : null,
      instructions: echo.instructions,
      max_output_tokens: echo.maxOutputTokens,
      model: this.meta.model,
      output: status === 'in_progress' ? [] : [this.item(true)],
      parallel_tool_calls: echo.parallelToolCalls,
      previous_response_id: null,
      reasoning: { effort: echo.reasoningEffort, summary: null },
      store: false,
      temperature: echo.temperature,
      text: { format: echo.textFormat },
      tool_choice: 'auto',
      tools: [],
      top_p: echo.topP,
      truncation: 'disabled',
      usage: usage === null ? null : {
        input_tokens: usage.prompt_tokens,
        input_tokens_details: { cached_tokens: usage.prompt_tokens_details.cached_tokens },
        output_tokens: usage.completion_tokens,
        output_tokens_details: { reasoning_tokens: 0 },
        total_tokens: usage.total_tokens,
      },
      user: echo.user,
      metadata: echo.metadata,
    };
  }

  openingChunks(): object[] {
    const started = this.response(null);
    return [
      this.event('response.created', { response: started }),
      this.event('response.in_progress', { response: started }),
      this.event('response.output_item.added', { output_index: 0, item: this.item(false) }),
      this.event('response.content_part.added', { item_id: this.itemId, output_index: 0, content_index: 0, part: this.part() }),
    ];
  }

  updateChunks(update: ChoiceUpdate): object[] {
    const chunks: object[] = [];
    if (update.textDelta) {
      this.text += update.textDelta;
      chunks.push(this.event('response.output_text.delta', {
        item_id: this.itemId, output_index: 0, content_index: 0, delta: update.textDelta, logprobs: [],
      }));
    }
    if (update.finishReason) {
      this.finishReason = update.finishReason;
      chunks.push(
        this.event('response.output_text.done', { item_id: this.itemId, output_index: 0, content_index: 0, text: this.text, logprobs: [] }),
        this.event('response.content_part.done', { item_id: this.itemId, output_index: 0, content_index: 0, part: this.part() }),
        this.event('response.output_item.done', { output_index: 0, item: this.item(true) }),
      );
    }
    return chunks;
  }

  /** The stream's last event: the whole response, usage included (the request's include_usage is always on). */
  usageChunk(usage: WireUsage): object {
    return this.event(this.status === 'completed' ? 'response.completed' : 'response.incomplete', { response: this.response(usage) });
  }

  collect(update: ChoiceUpdate): void {
    this.text += update.textDelta;
    if (update.finishReason) this.finishReason = update.finishReason;
  }

  body(usage: WireUsage): object {
    return this.response(usage);
  }

  errorEvent(body: ErrorBody): object {
    const { message, code, param } = body.error;
    return this.event('error', { code, message, param });
  }
}
