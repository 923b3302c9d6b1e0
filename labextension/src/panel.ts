/**
 * The sidebar widget: one card per device, its holders, and a recommendation for the active
 * notebook. It polls the server extension with backoff while visible and stops when hidden;
 * every failure is shown in the panel, never thrown at the user.
 *
 * For a notebook whose kernel was started by the autogpu kernelspec, the card of the device
 * it holds has a "Move to best GPU" button and the other cards a "Move here" button: after a
 * confirmation dialog (the plan from the server's dry run: the kernel restarts and loses its
 * state) the server records the move and the notebook's kernel is restarted the way
 * JupyterLab's own "Restart Kernel" does it (so the notebook follows: its kernel indicator,
 * widgets and pending requests); the panel shows where the kernel runs now.
 *
 * Every word of the panel goes through JupyterLab's translator (`ITranslator`).
 *
 * All text from the server (device names, other users' names and notebook paths) is inserted
 * with `textContent`, never as HTML.
 */
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import {
  ITranslator,
  TranslationBundle,
  nullTranslator
} from '@jupyterlab/translation';
import { Poll } from '@lumino/polling';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import {
  IFleet,
  IHolders,
  IKernelInfo,
  IMoveAction,
  IPickOutcome,
  ISelection,
  ISeries,
  confirmLabel,
  deviceState,
  formatMemory,
  formatPct,
  formatThermals,
  formatUserTotal,
  holdersFor,
  nobodyText,
  kernelInfoFor,
  kernelSelection,
  mergeHistory,
  moveActionFor,
  myDevices,
  overloadAdvice,
  overloadToNotify,
  pickCodeFor,
  parseFleet,
  parseHistory,
  parseHolders,
  parseMoveResult,
  parseSelection,
  notebookDevices,
  recommendationAction,
  recommendationText,
  selectPath,
  sparkScaleTop,
  sparklinePath,
  uniqueErrors,
  unsupportedNote,
  userTotals,
  waitsEnded
} from './model';
import { MISSING_SERVER_EXTENSION, requestAPI } from './request';
import { ClusterSection } from './cluster';

/** What the panel needs to know about the active notebook. */
export interface IActiveNotebook {
  path: string;
  kernelId: string | null;
  /** Run code in the notebook's kernel; what it printed, and whether it failed. */
  execute?: (code: string) => Promise<IExecuteResult>;
  /** Restart the notebook's kernel as JupyterLab's "Restart Kernel" does (no dialog). */
  restart?: () => Promise<void>;
}

/** The outcome of code the panel ran in a notebook's kernel. */
export interface IExecuteResult {
  ok: boolean;
  text: string;
  /** The answer of the sidebar's pick (its `PICK_MIME` display), if the code gave one. */
  pick: IPickOutcome | null;
}

/** Options of {@link GPUPanel}. */
export interface IGPUPanelOptions {
  serverSettings?: ServerConnection.ISettings;
  /** The active notebook, asked at each render (null: none). */
  activeNotebook: () => IActiveNotebook | null;
  /** JupyterLab's translator (default: none, the English strings). */
  translator?: ITranslator;
}

/** Settings from the settings registry (`schema/plugin.json`). */
export interface IPanelSettings {
  refreshInterval: number;
  recommendMinFree: string;
  historyPoints: number;
}

const SVG_NS = 'http://www.w3.org/2000/svg';
const SPARK_W = 120;
const SPARK_H = 24;
/** Pixels kept free above 100 % and below 0, so a flat line at either end stays visible. */
const SPARK_PAD = 2;
const MAX_BACKOFF_MS = 60000;

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

function errorText(reason: unknown, trans: TranslationBundle): string {
  if (
    reason instanceof ServerConnection.ResponseError &&
    reason.message === MISSING_SERVER_EXTENSION
  ) {
    return trans.__(MISSING_SERVER_EXTENSION); // the whole story: no status code in front
  }
  if (reason instanceof ServerConnection.ResponseError) {
    return trans.__(
      'server answered %1: %2',
      reason.response.status,
      reason.message
    );
  }
  if (reason instanceof Error) {
    return reason.message;
  }
  return String(reason);
}

/** The last pick or move of a kernel, shown while that kernel's notebook is active. */
interface IMoveStatus {
  kernelId: string;
  text: string;
  failed: boolean;
  busy: boolean;
  /** More lines, behind a toggle (one line is what the sidebar has room for). */
  details: string;
}

/** The server's message alone (it is written for people), else the generic text. */
function moveErrorText(reason: unknown, trans: TranslationBundle): string {
  if (reason instanceof ServerConnection.ResponseError) {
    return reason.message;
  }
  return errorText(reason, trans);
}

/** The GPU sidebar. */
export class GPUPanel extends Widget {
  constructor(options: IGPUPanelOptions) {
    super();
    this.id = 'jp-AutoGPU-panel';
    this.addClass('jp-AutoGPU-panel');
    this._serverSettings =
      options.serverSettings ?? ServerConnection.makeSettings();
    this._activeNotebook = options.activeNotebook;
    this._trans = (options.translator ?? nullTranslator).load(
      'autogpu_jupyter'
    );
    const trans = this._trans;
    this._poll = new Poll({
      auto: false,
      factory: () => this.refresh(),
      frequency: {
        interval: this._settings.refreshInterval * 1000,
        backoff: true,
        max: MAX_BACKOFF_MS
      },
      name: 'autogpu:sidebar',
      standby: 'when-hidden'
    });
    this._status = el('div', 'jp-AutoGPU-status', trans.__('loading…'));
    this._errors = el('div', 'jp-AutoGPU-errors');
    this._recommendation = el('div', 'jp-AutoGPU-recommendation');
    this._moveStatus = el('div', 'jp-AutoGPU-moveStatus');
    this._moveStatus.setAttribute('role', 'status');
    this._cards = el('div', 'jp-AutoGPU-cards');
    this._totals = el('div', 'jp-AutoGPU-totals');
    const header = el('div', 'jp-AutoGPU-header');
    header.appendChild(el('h2', 'jp-AutoGPU-title', trans.__('GPUs')));
    header.appendChild(this._status);
    const filter = el('label', 'jp-AutoGPU-filter');
    this._onlyMineBox = el('input', 'jp-AutoGPU-onlyMine');
    this._onlyMineBox.type = 'checkbox';
    this._onlyMineBox.addEventListener('change', () => {
      this._render(this._lastErrors);
    });
    filter.append(
      this._onlyMineBox,
      document.createTextNode(' ' + trans.__('only my GPUs'))
    );
    this.node.append(
      header,
      this._errors,
      this._recommendation,
      this._moveStatus,
      filter,
      this._totals,
      this._cards
    );
    this._cluster = new ClusterSection(this._serverSettings, this._trans);
    this.node.appendChild(this._cluster.node);
  }

  /** Apply settings; a new interval takes effect at the next tick. */
  updateSettings(settings: IPanelSettings): void {
    this._settings = settings;
    this._poll.frequency = {
      interval: Math.max(settings.refreshInterval, 0.5) * 1000,
      backoff: true,
      max: MAX_BACKOFF_MS
    };
    if (this.isVisible) {
      void this._poll.refresh();
    }
  }

  /** Fetch everything once and render. Rejects (so that the poll backs off) on failure. */
  async refresh(): Promise<void> {
    const since = this._until === null ? '' : `?since=${this._until}`;
    const active = this._activeNotebook();
    // The active notebook's own lease must not count against the device it holds.
    const selectQuery = selectPath(
      this._settings.recommendMinFree,
      active?.kernelId ?? null
    );
    const errors: string[] = [];
    void this._cluster.refresh(this._settings.recommendMinFree);
    try {
      const [fleetRaw, historyRaw, holdersRaw] = await Promise.all([
        requestAPI<unknown>('devices', this._serverSettings),
        requestAPI<unknown>(`history${since}`, this._serverSettings),
        requestAPI<unknown>('holders', this._serverSettings)
      ]);
      this._fleet = parseFleet(fleetRaw);
      const history = parseHistory(historyRaw);
      this._series = mergeHistory(
        this._series,
        history,
        this._settings.historyPoints
      );
      this._until = history.until_s ?? this._until;
      this._holders = parseHolders(holdersRaw);
      errors.push(...this._fleet.errors, ...this._holders.errors);
    } catch (reason) {
      this._failure = errorText(reason, this._trans);
      this._render(errors);
      throw reason;
    }
    if (this._fleet.devices.length === 0) {
      // no GPU data (the reason is in the errors above): nothing to recommend, and the
      // select's 503 would only say the same again
      this._selection = null;
      this._selectionError = null;
    } else {
      try {
        this._selection = parseSelection(
          await requestAPI<unknown>(selectQuery, this._serverSettings)
        );
        this._selectionError = null;
      } catch (reason) {
        this._selection = null;
        this._selectionError = errorText(reason, this._trans);
      }
    }
    this._failure = null;
    this._render(errors, active);
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._poll.start();
    void this._poll.refresh();
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    void this._poll.stop();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    super.dispose();
  }

  /** The poll (for tests and the plugin). */
  get poll(): Poll {
    return this._poll;
  }

  private _render(
    errors: string[],
    active: IActiveNotebook | null = this._activeNotebook()
  ): void {
    this._lastErrors = errors;
    this._errors.replaceChildren();
    const trans = this._trans;
    const all = uniqueErrors(
      this._failure ? [this._failure, ...errors] : errors
    );
    for (const message of all) {
      this._errors.appendChild(el('div', 'jp-AutoGPU-error', message));
    }
    const fleet = this._fleet;
    if (fleet === null) {
      this._status.textContent = this._failure
        ? trans.__('unavailable')
        : trans.__('loading…');
      return;
    }
    this._status.replaceChildren();
    if (fleet.simulated) {
      this._status.appendChild(
        el(
          'span',
          'jp-AutoGPU-badge jp-AutoGPU-simulated',
          trans.__('simulated')
        )
      );
    }
    const stamp = new Date(fleet.timestamp_s * 1000).toLocaleTimeString();
    this._status.appendChild(
      el(
        'span',
        'jp-AutoGPU-stamp',
        this._failure
          ? trans.__('stale, last %1', stamp)
          : trans.__('updated %1', stamp)
      )
    );
    this._renderRecommendation(active);
    this._renderMoveStatus(active);
    this._notifyOverload(active);
    if (this._holders !== null) {
      for (const text of waitsEnded(this._holders, this._waiting, trans)) {
        Notification.success(text, { autoClose: false });
      }
    }
    this._renderTotals();
    this._renderCards(fleet, active);
  }

  /**
   * A JupyterLab notification (it stays until dismissed) when the active notebook's GPU gets
   * overloaded by other processes, once per overload; the server's words, as in the panel.
   */
  private _notifyOverload(active: IActiveNotebook | null): void {
    const kernel = kernelInfoFor(this._holders, active?.kernelId ?? null);
    const text = overloadToNotify(kernel, this._overloadShown);
    if (text !== null) {
      Notification.warning(text, { autoClose: false });
    }
  }

  /** One line per user: how many GPUs, how much memory booked and used. */
  private _renderTotals(): void {
    this._totals.replaceChildren();
    const totals = userTotals(this._holders?.holders ?? []);
    for (const total of totals) {
      const line = el(
        'div',
        'jp-AutoGPU-total',
        formatUserTotal(total, this._trans)
      );
      if (total.user === this._holders?.user) {
        line.classList.add('jp-AutoGPU-total-mine');
      }
      this._totals.appendChild(line);
    }
  }

  private _renderMoveStatus(active: IActiveNotebook | null): void {
    const status = this._move;
    this._moveStatus.replaceChildren();
    if (status === null || active?.kernelId !== status.kernelId) {
      return;
    }
    this._moveStatus.appendChild(
      el(
        'div',
        status.failed
          ? 'jp-AutoGPU-moveMessage jp-AutoGPU-moveFailed'
          : 'jp-AutoGPU-moveMessage',
        status.text
      )
    );
    if (status.details) {
      // one line is what the sidebar has room for; the rest on demand
      const more = el('details', 'jp-AutoGPU-moveDetails');
      more.append(
        el(
          'summary',
          'jp-AutoGPU-moveDetailsToggle',
          this._trans.__('details')
        ),
        el('pre', 'jp-AutoGPU-moveDetailsText', status.details)
      );
      this._moveStatus.appendChild(more);
    }
  }

  private _setMoveStatus(
    kernelId: string,
    text: string,
    failed = false,
    busy = false,
    details = ''
  ): void {
    this._move = { kernelId, text, failed, busy, details };
    this._renderMoveStatus(this._activeNotebook());
    this._cards.querySelectorAll('button').forEach(button => {
      button.disabled = busy;
    });
    this._recommendation.querySelectorAll('button').forEach(button => {
      button.disabled = busy;
    });
  }

  /**
   * Ask the server for the plan (dry run), confirm with the user, then move: the server records
   * the request, the notebook's kernel restarts the way JupyterLab's own "Restart Kernel" does
   * (the provisioner honours the request at the restart), and the server says where the kernel
   * runs now. A restart that did not happen leaves nothing pending: the request is dropped.
   */
  private async _onMove(
    kernel: IKernelInfo,
    action: IMoveAction,
    restart: (() => Promise<void>) | undefined
  ): Promise<void> {
    const trans = this._trans;
    const kernelId = kernel.kernel_id;
    const url = `kernels/${encodeURIComponent(kernelId)}/move`;
    const post = (dryRun: boolean, serverRestarts: boolean) =>
      requestAPI<unknown>(url, this._serverSettings, {
        method: 'POST',
        body: JSON.stringify({
          target: action.target,
          dry_run: dryRun,
          restart: serverRestarts
        })
      });
    this._setMoveStatus(kernelId, trans.__('checking the move…'), false, true);
    let plan;
    try {
      plan = parseMoveResult(await post(true, false));
    } catch (reason) {
      this._setMoveStatus(
        kernelId,
        trans.__('cannot move: %1', moveErrorText(reason, trans)),
        true
      );
      return;
    }
    const body = el('div', 'jp-AutoGPU-moveDialog');
    body.append(
      el('p', 'jp-AutoGPU-movePlan', plan.message),
      // The plan already says that the kernel's state is lost: say only what stays.
      el(
        'p',
        'jp-AutoGPU-moveWarning',
        trans.__(
          'The outputs already in %1 stay.',
          kernel.notebook_path ?? trans.__('the notebook')
        )
      )
    );
    const answer = await showDialog({
      title: trans.__('Restart the kernel on another GPU?'),
      body: new Widget({ node: body }),
      buttons: [
        Dialog.cancelButton({ label: trans.__('Cancel') }),
        Dialog.warnButton({ label: confirmLabel(plan, trans) })
      ]
    });
    if (!answer.button.accept) {
      this._setMoveStatus(
        kernelId,
        trans.__('move cancelled: nothing changed')
      );
      return;
    }
    this._setMoveStatus(
      kernelId,
      trans.__('restarting the kernel on %1…', plan.target_labels.join(', ')),
      false,
      true
    );
    try {
      if (restart === undefined) {
        // no notebook to restart it through (another frontend): the server restarts it
        const result = parseMoveResult(await post(false, true));
        this._setMoveStatus(kernelId, result.message);
      } else {
        parseMoveResult(await post(false, false)); // recorded for the restart
        await restart();
        let result = parseMoveResult(
          await requestAPI<unknown>(url, this._serverSettings)
        );
        if (result.pending) {
          // the restart did not happen (JupyterLab logs why): no move may wait for a later one
          await requestAPI<unknown>(url, this._serverSettings, {
            method: 'DELETE'
          });
          result = {
            ...result,
            message: trans.__('the kernel did not restart: nothing moved')
          };
          this._setMoveStatus(kernelId, result.message, true);
        } else {
          this._setMoveStatus(kernelId, result.message);
        }
      }
    } catch (reason) {
      this._setMoveStatus(
        kernelId,
        trans.__('move failed: %1', moveErrorText(reason, trans)),
        true
      );
    }
    void this._poll.refresh();
  }

  /**
   * The sidebar's pick in the notebook's own kernel, on one device: its one-line outcome, the
   * rest behind a toggle.
   */
  private async _onPick(
    kernelId: string,
    label: string,
    code: string,
    execute: (code: string) => Promise<IExecuteResult>
  ): Promise<void> {
    const trans = this._trans;
    this._setMoveStatus(
      kernelId,
      trans.__("picking %1 in this notebook's kernel…", label),
      false,
      true
    );
    try {
      const result = await execute(code);
      if (result.pick !== null) {
        this._setMoveStatus(
          kernelId,
          result.pick.summary,
          !result.pick.ok,
          false,
          result.pick.details
        );
      } else {
        // no answer from autogpu (an older version in that kernel, an error before it ran):
        // the first line, and the rest on demand
        const lines = result.text.trim().split('\n');
        this._setMoveStatus(
          kernelId,
          lines[0] || trans.__('the pick failed'),
          true,
          false,
          lines.slice(1).join('\n')
        );
      }
    } catch (reason) {
      this._setMoveStatus(
        kernelId,
        trans.__('pick failed: %1', errorText(reason, trans)),
        true
      );
    }
    void this._poll.refresh();
  }

  private _renderRecommendation(active: IActiveNotebook | null): void {
    this._recommendation.replaceChildren();
    const kernelId = active?.kernelId ?? null;
    const kernel = kernelInfoFor(this._holders, kernelId);
    const overload = overloadAdvice(kernel);
    const devices = this._fleet?.devices ?? [];
    // an autogpu kernel on a GPU is told the server's decision for it (its move plan's)
    const selection = kernelSelection(this._selection, kernel, devices);
    if (
      overload === null &&
      this._selection === null &&
      this._selectionError === null
    ) {
      return;
    }
    if (active !== null) {
      this._recommendation.appendChild(
        el('div', 'jp-AutoGPU-notebook', active.path)
      );
    }
    // An overloaded notebook is told what the notification and the cell's warning tell it
    // (one "better GPU" answer); otherwise the best device for the sidebar's request.
    const text =
      overload !== null
        ? overload.text
        : selection !== null
          ? recommendationText(
              selection,
              notebookDevices(this._holders, kernelId),
              this._trans
            )
          : this._trans.__('no recommendation: %1', this._selectionError);
    this._recommendation.classList.toggle(
      'jp-AutoGPU-overloaded',
      overload !== null
    );
    this._recommendation.appendChild(el('div', 'jp-AutoGPU-advice', text));
    if (kernel !== null && kernel.cull_warning !== null) {
      // the server will soon shut this idle kernel down (its notification says the same)
      this._recommendation.appendChild(
        el('div', 'jp-AutoGPU-cullWarning', kernel.cull_warning)
      );
    }
    // the line carries its action: the first button a newcomer sees is the right one
    const action = recommendationAction(
      selection,
      kernel,
      this._holders,
      kernelId,
      devices,
      this._trans
    );
    if (action === null || active === null || kernelId === null) {
      return;
    }
    const button = el(
      'button',
      `jp-AutoGPU-recommendAction jp-AutoGPU-recommend-${action.kind}`,
      action.label
    );
    button.type = 'button';
    button.title = action.title;
    button.disabled = this._move?.busy === true;
    if (action.kind === 'move' && kernel !== null) {
      button.addEventListener('click', () => {
        void this._onMove(
          kernel,
          {
            kind: 'here',
            target: action.target,
            label: action.label,
            title: action.title
          },
          active.restart
        );
      });
    } else if (action.kind === 'pick' && active.execute) {
      const execute = active.execute;
      button.addEventListener('click', () => {
        void this._onPick(kernelId, action.where, action.code, execute);
      });
    } else {
      return;
    }
    this._recommendation.appendChild(button);
  }

  /** The card that gets the "best" badge: the overload's better device, else the line's. */
  private _bestUuids(active: IActiveNotebook | null): string[] {
    const kernel = kernelInfoFor(this._holders, active?.kernelId ?? null);
    const overload = overloadAdvice(kernel);
    if (overload !== null) {
      return overload.uuid !== null ? [overload.uuid] : [];
    }
    const selection = kernelSelection(
      this._selection,
      kernel,
      this._fleet?.devices ?? []
    );
    return selection?.chosen.map(c => c.uuid) ?? [];
  }

  private _renderCards(fleet: IFleet, active: IActiveNotebook | null): void {
    const trans = this._trans;
    this._cards.replaceChildren();
    if (fleet.devices.length === 0) {
      this._cards.appendChild(
        el('div', 'jp-AutoGPU-empty', trans.__('No GPU visible to the server.'))
      );
      return;
    }
    const best = this._bestUuids(active);
    const holders: IHolders = this._holders ?? {
      timestamp_s: 0,
      simulated: false,
      user: '',
      holders: [],
      kernels: [],
      errors: []
    };
    const kernelId = active?.kernelId ?? null;
    const kernel = kernelInfoFor(holders, kernelId);
    const busy = this._move?.busy === true;
    const mine = myDevices(holders, kernelId);
    const onlyMine = this._onlyMineBox.checked;
    let shown = 0;
    for (const device of fleet.devices) {
      if (onlyMine && !mine.has(device.uuid)) {
        continue;
      }
      shown += 1;
      const state = deviceState(device);
      const card = el('div', `jp-AutoGPU-card jp-AutoGPU-${state}`);
      card.dataset.uuid = device.uuid;
      const title = el('div', 'jp-AutoGPU-cardTitle');
      title.appendChild(el('span', 'jp-AutoGPU-label', device.label));
      // The badge sits before the model's name, so it never squeezes the name into "NVIDIA…"
      if (best.includes(device.uuid)) {
        title.appendChild(
          el('span', 'jp-AutoGPU-badge jp-AutoGPU-best', trans.__('best'))
        );
      }
      const name = el('span', 'jp-AutoGPU-name', device.name);
      name.title = device.name;
      title.appendChild(name);
      card.appendChild(title);
      if (state === 'lost') {
        card.appendChild(
          el(
            'div',
            'jp-AutoGPU-lostNote',
            trans.__('lost: %1', device.error ?? trans.__('not readable'))
          )
        );
        this._cards.appendChild(card);
        continue;
      }
      const series = this._series.get(device.uuid);
      card.appendChild(
        this._metric(
          'util',
          trans.__('Util'),
          formatPct(device.utilization_pct, trans),
          series ? series.utilization_pct : [],
          100
        )
      );
      const memSeries = series ? series.memory_used_bytes : [];
      card.appendChild(
        this._metric(
          'mem',
          trans.__('Mem'),
          formatMemory(device),
          memSeries,
          device.memory_total_bytes ?? series?.memory_total_bytes ?? 0
        )
      );
      const thermals = formatThermals(device);
      if (thermals) {
        card.appendChild(el('div', 'jp-AutoGPU-thermals', thermals));
      }
      const note = unsupportedNote(device, trans);
      if (note) {
        card.appendChild(el('div', 'jp-AutoGPU-unsupported', note));
      }
      const views = holdersFor(
        holders.holders,
        device.uuid,
        kernelId,
        holders.kernels,
        trans
      );
      const list = el('ul', 'jp-AutoGPU-holders');
      for (const view of views) {
        const item = el(
          'li',
          view.current
            ? 'jp-AutoGPU-holder jp-AutoGPU-holder-current'
            : 'jp-AutoGPU-holder'
        );
        const what = el('span', 'jp-AutoGPU-what', view.what);
        if (view.command) {
          what.title = view.command;
        }
        item.append(el('span', 'jp-AutoGPU-who', view.who), what);
        if (view.memory) {
          item.appendChild(el('span', 'jp-AutoGPU-holderMem', view.memory));
        }
        if (view.idle) {
          item.appendChild(el('span', 'jp-AutoGPU-idle', view.idle));
        }
        if (view.exclusive) {
          // the words say "exclusive" (the server's memory_text); the line is marked too
          item.classList.add('jp-AutoGPU-holder-exclusive');
        }
        list.appendChild(item);
      }
      if (views.length === 0) {
        list.appendChild(
          el('li', 'jp-AutoGPU-holder jp-AutoGPU-free', nobodyText(trans))
        );
      }
      card.appendChild(list);
      const pickCode = pickCodeFor(device, kernel, this._holders, kernelId);
      if (pickCode !== null && active?.execute && kernelId !== null) {
        const button = el(
          'button',
          'jp-AutoGPU-move jp-AutoGPU-pick',
          trans.__('Pick for this notebook')
        );
        button.type = 'button';
        button.title = trans.__(
          "Pick %1 for %2: %gpu pick in the notebook's own kernel, on this GPU only",
          device.label,
          active.path
        );
        button.disabled = busy;
        const execute = active.execute;
        button.addEventListener('click', () => {
          void this._onPick(kernelId, device.label, pickCode, execute);
        });
        card.appendChild(button);
      }
      const action = moveActionFor(device, kernel, trans);
      if (action !== null && kernel !== null) {
        const button = el(
          'button',
          `jp-AutoGPU-move jp-AutoGPU-move-${action.kind}`,
          action.label
        );
        button.type = 'button';
        button.title = action.title;
        button.disabled = busy;
        button.addEventListener('click', () => {
          void this._onMove(kernel, action, active?.restart);
        });
        card.appendChild(button);
      }
      this._cards.appendChild(card);
    }
    if (onlyMine && shown === 0) {
      this._cards.appendChild(
        el(
          'div',
          'jp-AutoGPU-empty',
          trans.__('You hold no GPU here (untick "only my GPUs" to see all).')
        )
      );
    }
  }

  private _metric(
    key: string,
    label: string,
    value: string,
    values: (number | null)[],
    max: number
  ): HTMLElement {
    // Label and value on one line, the sparkline below at the card's full width: every
    // sparkline has the same width whatever its value's text, with its scale beside it.
    const row = el('div', `jp-AutoGPU-metric jp-AutoGPU-${key}`);
    const head = el('div', 'jp-AutoGPU-metricHead');
    head.append(
      el('span', 'jp-AutoGPU-metricLabel', label),
      el('span', 'jp-AutoGPU-metricValue', value)
    );
    row.appendChild(head);
    const box = el('div', 'jp-AutoGPU-sparkBox');
    const svg = document.createElementNS(SVG_NS, 'svg');
    svg.setAttribute('class', 'jp-AutoGPU-spark');
    svg.setAttribute('viewBox', `0 0 ${SPARK_W} ${SPARK_H}`);
    svg.setAttribute('preserveAspectRatio', 'none');
    const mid = document.createElementNS(SVG_NS, 'line');
    mid.setAttribute('class', 'jp-AutoGPU-sparkGrid');
    mid.setAttribute('x1', '0');
    mid.setAttribute('x2', String(SPARK_W));
    mid.setAttribute('y1', String(SPARK_H / 2));
    mid.setAttribute('y2', String(SPARK_H / 2));
    svg.appendChild(mid);
    const path = document.createElementNS(SVG_NS, 'path');
    path.setAttribute(
      'd',
      sparklinePath(
        values,
        SPARK_W,
        SPARK_H,
        max,
        this._settings.historyPoints,
        SPARK_PAD
      )
    );
    svg.appendChild(path);
    box.appendChild(svg);
    const scale = el('div', 'jp-AutoGPU-scale');
    scale.append(
      el(
        'span',
        'jp-AutoGPU-scaleTop',
        sparkScaleTop(key === 'util' ? 'util' : 'mem', max)
      ),
      el('span', 'jp-AutoGPU-scaleBottom', '0')
    );
    box.appendChild(scale);
    row.appendChild(box);
    return row;
  }

  private _serverSettings: ServerConnection.ISettings;
  private _trans: TranslationBundle;
  private _activeNotebook: () => IActiveNotebook | null;
  private _poll: Poll;
  private _settings: IPanelSettings = {
    refreshInterval: 2,
    recommendMinFree: '10G',
    historyPoints: 120
  };
  private _status: HTMLElement;
  private _errors: HTMLElement;
  private _recommendation: HTMLElement;
  private _moveStatus: HTMLElement;
  private _move: IMoveStatus | null = null;
  private _cards: HTMLElement;
  private _totals: HTMLElement;
  private _onlyMineBox: HTMLInputElement;
  private _lastErrors: string[] = [];
  private _overloadShown = new Map<string, string>();
  private _waiting = new Set<string>();
  private _cluster: ClusterSection;
  private _fleet: IFleet | null = null;
  private _holders: IHolders | null = null;
  private _selection: ISelection | null = null;
  private _selectionError: string | null = null;
  private _series = new Map<string, ISeries>();
  private _until: number | null = null;
  private _failure: string | null = null;
}
