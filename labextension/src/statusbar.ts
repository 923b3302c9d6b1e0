/**
 * The active notebook's GPU in the status bar (JupyterLab) or in the top bar (Notebook 7,
 * whose shell has no status bar): `GPU 2 · 35% · 20.0 GiB / 80.0 GiB`, a warning mark when
 * the server says other processes overload it, nothing for a kernel without a GPU. A click
 * opens the GPU sidebar.
 *
 * It polls the server's `devices` and `holders` answers (the sidebar's own) while the page is
 * visible; every figure and warning comes from the server (`gpuStatus` in `model.ts` only
 * arranges them). The same poll tells the notebook's user, with a JupyterLab notification,
 * that the server will soon cull the idle kernel and free its GPU (`cull_warning`).
 *
 * Words go through the extension's translation bundle; server text is set with `textContent`.
 */
import { Notification } from '@jupyterlab/apputils';
import { ServerConnection } from '@jupyterlab/services';
import {
  ITranslator,
  TranslationBundle,
  nullTranslator
} from '@jupyterlab/translation';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import {
  IGPUStatus,
  cullWarningToNotify,
  gpuStatus,
  kernelInfoFor,
  parseFleet,
  parseHolders
} from './model';
import { requestAPI } from './request';

const MAX_BACKOFF_MS = 60000;

/** Options of {@link GPUStatusItem}. */
export interface IGPUStatusOptions {
  serverSettings?: ServerConnection.ISettings;
  /** The active notebook's kernel id (null: no notebook, or no kernel). */
  activeKernelId: () => string | null;
  /** Open the GPU sidebar. */
  openSidebar: () => void;
  translator?: ITranslator;
  /** Seconds between two refreshes. */
  interval?: number;
}

/** The status item. */
export class GPUStatusItem extends Widget {
  constructor(options: IGPUStatusOptions) {
    super();
    this.id = 'jp-AutoGPU-statusItem';
    this.addClass('jp-AutoGPU-statusItem');
    this._serverSettings =
      options.serverSettings ?? ServerConnection.makeSettings();
    this._activeKernelId = options.activeKernelId;
    this._trans = (options.translator ?? nullTranslator).load(
      'autogpu_jupyter'
    );
    this.node.setAttribute('role', 'button');
    this.node.tabIndex = 0;
    this._mark = document.createElement('span');
    this._mark.className = 'jp-AutoGPU-statusMark';
    this._text = document.createElement('span');
    this._text.className = 'jp-AutoGPU-statusText';
    this.node.append(this._mark, this._text);
    this.node.addEventListener('click', () => options.openSidebar());
    this.node.addEventListener('keydown', (event: KeyboardEvent) => {
      if (event.key === 'Enter' || event.key === ' ') {
        event.preventDefault();
        options.openSidebar();
      }
    });
    this._poll = new Poll({
      auto: true,
      factory: () => this.refresh(),
      frequency: {
        interval: Math.max(options.interval ?? 5, 0.5) * 1000,
        backoff: true,
        max: MAX_BACKOFF_MS
      },
      name: 'autogpu:statusbar',
      standby: 'when-hidden'
    });
    this._show(null);
  }

  /** Whether the item has something to show (the status bar's `isActive`). */
  get active(): boolean {
    return this._status !== null;
  }

  /** Emitted when the item appears or disappears. */
  get activeChanged(): ISignal<this, void> {
    return this._activeChanged;
  }

  /** Refresh now (the active notebook changed). */
  refreshNow(): void {
    void this._poll.refresh();
  }

  /** A new refresh interval, in seconds. */
  set interval(seconds: number) {
    this._poll.frequency = {
      interval: Math.max(seconds, 0.5) * 1000,
      backoff: true,
      max: MAX_BACKOFF_MS
    };
  }

  /** Fetch the devices and holders, and show the active notebook's GPU. */
  async refresh(): Promise<void> {
    const kernelId = this._activeKernelId();
    if (kernelId === null) {
      this._show(null);
      return;
    }
    let status: IGPUStatus | null = null;
    try {
      const [fleetRaw, holdersRaw] = await Promise.all([
        requestAPI<unknown>('devices', this._serverSettings),
        requestAPI<unknown>('holders', this._serverSettings)
      ]);
      const holders = parseHolders(holdersRaw);
      // the notebook may have changed meanwhile: show the one active now
      const now = this._activeKernelId();
      status = gpuStatus(holders, parseFleet(fleetRaw), now, this._trans);
      const warning = cullWarningToNotify(
        kernelInfoFor(holders, now),
        this._cullShown
      );
      if (warning !== null) {
        Notification.warning(warning, { autoClose: false });
      }
    } catch (reason) {
      // the sidebar says why (its errors); the status bar stays quiet
      this._show(null);
      throw reason;
    }
    this._show(status);
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    super.dispose();
  }

  private _show(status: IGPUStatus | null): void {
    const was = this._status !== null;
    this._status = status;
    this.node.classList.toggle(
      'jp-AutoGPU-statusOverloaded',
      status?.overloaded === true
    );
    // the mark is text only while shown (a reader of the item's text gets no stray sign)
    this._mark.hidden = status?.overloaded !== true;
    this._mark.textContent = status?.overloaded === true ? '⚠' : '';
    this._text.textContent = status?.text ?? '';
    this.node.title = status?.title ?? '';
    this.node.setAttribute(
      'aria-label',
      status === null ? '' : this._trans.__('GPU: %1', status.text)
    );
    this.setHidden(status === null);
    if (was !== (status !== null)) {
      this._activeChanged.emit();
    }
  }

  private _serverSettings: ServerConnection.ISettings;
  private _activeKernelId: () => string | null;
  private _trans: TranslationBundle;
  private _poll: Poll;
  private _mark: HTMLElement;
  private _text: HTMLElement;
  private _status: IGPUStatus | null = null;
  private _cullShown = new Set<string>();
  private _activeChanged = new Signal<this, void>(this);
}
