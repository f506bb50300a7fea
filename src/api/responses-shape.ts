// OpenAI's Responses API on the wire: a `response` object whose output is one assistant message of output_text, and
// the typed stream events that build it (response.created ... response.output_text.delta ... response.completed),
// each an SSE event named by its type and numbered by sequence_number, with no [DONE] after the last.

import type { ErrorBody } from './errors.ts';
import type { ChatResponseMeta, WireFinishReason, WireUsage } from './openai-format.ts';
import type { ChoiceUpdate, ResponseShape } from './response-shapes.ts';
import type { ResponsesEcho } from './schemas/responses.ts';
import type { SseStyle } from './sse.ts';

type Status = 'in_progress' | 'completed' | 'incomplete' | 'failed';

/** A chat message's tool call, as ToolChatShape's body gives it. */
interface ChatToolCall { id: string; function: { name: string; arguments: string } }

/**
 * With tools the output is read by the chat completion's tool-call shape (`tools`), which knows which text is a call:
 * the items (a message with any text, then a function_call per call) are known only when the output is complete, so a
 * stream sends their events then.
 */
export class ResponsesShape implements ResponseShape, SseStyle {
  readonly namedEvents = true;
  readonly doneMarker = false;
  private sequence = 0;
  private text = '';
  private finishReason: WireFinishReason | null = null;
  private readonly itemId: string;
  private readonly suffix: string;
  /** With tools: the calls of the finished output (the message's text is then `text`). */
  private calls: ChatToolCall[] = [];
  /** Set when the stream fails after it began: an item still being written was cut short. */
  private failed = false;

  /**
   * itemIdBase: the id the output items' ids are made of (the item's prefix, msg_ or fc_, instead of resp_), by default
   * the response's; as OpenAI's, the ids join prefix and body with an underscore.
   */
  constructor(private readonly meta: ChatResponseMeta, private readonly echo: ResponsesEcho, private readonly tools?: ResponseShape,
    itemIdBase: string = meta.id) {
    this.suffix = itemIdBase.replace(/^resp_/, '');
    this.itemId = `msg_${this.suffix}`;
  }

  get sseStyle(): SseStyle {
    return this;
  }

  private event(type: string, fields: object): object {
    return { type, sequence_number: this.sequence++, ...fields };
  }

  private get status(): Status {
    if (this.finishReason === null) return this.failed ? 'incomplete' : 'in_progress';
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

  private callItem(call: ChatToolCall, index: number, withArguments: boolean): object {
    // An output cut short (max_output_tokens) was cut inside its last call: that one is incomplete, the others whole.
    const status = this.status === 'incomplete' ? (index === this.calls.length - 1 ? 'incomplete' : 'completed') : this.status;
    return {
      id: `fc_${this.suffix}_${index}`, type: 'function_call', status,
      call_id: call.id, name: call.function.name, arguments: withArguments ? call.function.arguments : '',
    };
  }

  /** The finished output's items: the message (with tools, only when it has text), then the function calls. */
  private outputItems(): object[] {
    const items = this.tools === undefined || this.text !== '' || this.calls.length === 0 ? [this.item(true)] : [];
    return [...items, ...this.calls.map((call, i) => this.callItem(call, i, true))];
  }

  /**
   * The items the stream has added so far, for a response that failed: without tools the message (added when the
   * stream opened, "incomplete" unless it was finished); with tools nothing is added before the output is complete.
   */
  private shownItems(): object[] {
    if (this.tools === undefined) return [this.item(true)];
    return this.finishReason === null ? [] : this.outputItems();
  }

  /** With tools, once the output is complete: its text and calls, as the chat completion's tool-call shape reads them. */
  private readTools(): void {
    const body = this.tools!.body({ prompt_tokens: 0, completion_tokens: 0, total_tokens: 0, prompt_tokens_details: { cached_tokens: 0 } }) as {
      choices: { message: { content: string | null; tool_calls?: ChatToolCall[] } }[];
    };
    const message = body.choices[0]!.message;
    this.text = message.content ?? '';
    this.calls = message.tool_calls ?? [];
  }

  /**
   * The response object as it stands: in progress (no output yet), finished with its message and usage, or failed
   * with its error, the output the client was shown so far and the usage up to the failure.
   */
  private response(usage: WireUsage | null, failure?: { code: string | null; message: string }): object {
    const status: Status = failure ? 'failed' : this.status;
    const { echo } = this;
    return {
      id: this.meta.id,
      object: 'response',
      created_at: this.meta.created,
      status,
      error: failure ?? null,
      incomplete_details: status === 'incomplete' ? { reason: this.finishReason === 'length' ? 'max_output_tokens' : 'aborted' } : null,
      instructions: echo.instructions,
      max_output_tokens: echo.maxOutputTokens,
      model: this.meta.model,
      output: status === 'in_progress' ? [] : status === 'failed' ? this.shownItems() : this.outputItems(),
      parallel_tool_calls: echo.parallelToolCalls,
      previous_response_id: null,
      reasoning: { effort: echo.reasoningEffort, summary: null },
      store: false,
      temperature: echo.temperature,
      text: { format: echo.textFormat },
      tool_choice: echo.toolChoice,
      tools: echo.tools,
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
      ...(this.tools === undefined ? this.messageOpening() : []),
    ];
  }

  private messageOpening(outputIndex = 0): object[] {
    return [
      this.event('response.output_item.added', { output_index: outputIndex, item: this.item(false) }),
      this.event('response.content_part.added', { item_id: this.itemId, output_index: outputIndex, content_index: 0, part: { ...this.part(), text: '' } }),
    ];
  }

  private messageClosing(outputIndex = 0): object[] {
    return [
      this.event('response.output_text.done', { item_id: this.itemId, output_index: outputIndex, content_index: 0, text: this.text, logprobs: [] }),
      this.event('response.content_part.done', { item_id: this.itemId, output_index: outputIndex, content_index: 0, part: this.part() }),
      this.event('response.output_item.done', { output_index: outputIndex, item: this.item(true) }),
    ];
  }

  /** With tools, at the end: every item's events at once (a message's text as one delta, a call's arguments as one). */
  private toolOutputChunks(): object[] {
    const chunks: object[] = [];
    let index = 0;
    if (this.text !== '' || this.calls.length === 0) {
      chunks.push(...this.messageOpening(index));
      if (this.text !== '') {
        chunks.push(this.event('response.output_text.delta', {
          item_id: this.itemId, output_index: index, content_index: 0, delta: this.text, logprobs: [],
        }));
      }
      chunks.push(...this.messageClosing(index));
      index++;
    }
    this.calls.forEach((call, i) => {
      const item = this.callItem(call, i, true) as { id: string };
      chunks.push(
        this.event('response.output_item.added', { output_index: index, item: { ...this.callItem(call, i, false), status: 'in_progress' } }),
        this.event('response.function_call_arguments.delta', { item_id: item.id, output_index: index, delta: call.function.arguments }),
        this.event('response.function_call_arguments.done', { item_id: item.id, output_index: index, name: call.function.name, arguments: call.function.arguments }),
        this.event('response.output_item.done', { output_index: index, item }),
      );
      index++;
    });
    return chunks;
  }

  updateChunks(update: ChoiceUpdate): object[] {
    if (this.tools !== undefined) {
      this.collect(update);
      return update.finishReason ? this.toolOutputChunks() : [];
    }
    const chunks: object[] = [];
    if (update.textDelta) {
      this.text += update.textDelta;
      chunks.push(this.event('response.output_text.delta', {
        item_id: this.itemId, output_index: 0, content_index: 0, delta: update.textDelta, logprobs: [],
      }));
    }
    if (update.finishReason) {
      this.finishReason = update.finishReason;
      chunks.push(...this.messageClosing());
    }
    return chunks;
  }

  /** The stream's last event: the whole response, usage included (the request's include_usage is always on). */
  usageChunk(usage: WireUsage): object {
    return this.event(this.status === 'completed' ? 'response.completed' : 'response.incomplete', { response: this.response(usage) });
  }

  collect(update: ChoiceUpdate): void {
    if (this.tools !== undefined) {
      this.tools.collect(update);
      if (update.finishReason) {
        this.finishReason = update.finishReason;
        this.readTools();
      }
      return;
    }
    this.text += update.textDelta;
    if (update.finishReason) this.finishReason = update.finishReason;
  }

  body(usage: WireUsage): object {
    return this.response(usage);
  }

  /**
   * A stream failing after it began ends as OpenAI's does, with response.failed carrying the response, its status
   * "failed" and its error: clients (the openai package's responses.stream()) take the last response.* event as the
   * response, so it carries what was streamed (the message "incomplete" when cut short) and the usage up to then,
   * or the client would lose what it was shown. Before response.created there is no response to fail, so only an
   * `error` event.
   */
  errorEvent(body: ErrorBody, usage?: WireUsage): object {
    const { message, code, param } = body.error;
    if (this.sequence === 0) return this.event('error', { code, message, param });
    this.failed = true;
    return this.event('response.failed', { response: this.response(usage ?? null, { code, message }) });
  }
}
